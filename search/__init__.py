"""The staged driver: study files, storage, the stage loop, the CLI, status, report, export."""

"""Reads a study and shows it: status, report, export, the live console, progress, the plan, the user's trackers (imports engine and below)."""

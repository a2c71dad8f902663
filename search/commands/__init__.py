"""What the user types: the CLI, ``init`` from a verl script, ``validate``, the launcher a study file names (top layer)."""

"""Runs a study: the driver, one stage loop per stage, the trial runner, the stage's Optuna study, the final check, the events it emits (imports method, database, spec)."""

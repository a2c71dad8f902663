"""The study database: opening and checking storages, what is stored about trials and studies (records), heartbeats and re-queueing, Optuna's forked internals (imports spec only)."""

"""The method's rules, pure of processes: a stage worked out once, the stage policy, pruning, the sampler, probe lengths (imports database and spec)."""

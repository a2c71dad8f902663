"""``python -m verl_sweep``: the ``verl-sweep`` command."""
from verl_sweep.search.commands.cli import main

main()

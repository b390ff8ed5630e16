"""`python3 -m hp_tool ...`: the same as `hp-tool ...` and `python3 main.py ...`."""

from hp_tool.cli import main

main()

"""hp_tool: find the fastest way to train (and serve) an LLM on a cluster. See README.md.

    python3 main.py search_config=gpt3/5b dry_run=true
"""

from hp_tool.cli import main

if __name__ == "__main__":
    main()

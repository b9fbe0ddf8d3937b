"""Command line: `spin-indexer <command>`; see cli/main.py (one module per subcommand)."""

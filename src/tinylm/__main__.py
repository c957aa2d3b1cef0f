"""``python -m tinylm`` runs the command-line tool."""

from tinylm.cli import main

raise SystemExit(main())

"""`python -m launcher ...` is `specd ...`."""

from launcher.cli import main

raise SystemExit(main())

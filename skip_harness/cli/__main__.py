"""`python -m skip_harness.cli ...` runs the `skip-harness` command."""
import sys

from skip_harness.cli import main

sys.exit(main())

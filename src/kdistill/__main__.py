"""`python -m kdistill` runs the CLI."""

import sys

from kdistill.cli import main

sys.exit(main())

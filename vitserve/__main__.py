"""`python -m vitserve ...`: the `vitserve` command."""

import sys

from .service.entry.cli import main

sys.exit(main())

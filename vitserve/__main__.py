"""`python -m vitserve ...`: the `vitserve` command."""

import sys

from .service.cli import main

sys.exit(main())

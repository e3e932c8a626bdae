"""`python -m dhp_jax` is the `dhp` command."""

import sys

from dhp_jax.cli import main

sys.exit(main())

"""`python -m scalestudy.cli`: the `scalestudy` command, for hosts where the console script
is not on the PATH."""

import sys

from scalestudy.cli.main import main

sys.exit(main())

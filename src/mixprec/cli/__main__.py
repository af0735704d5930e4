"""``python -m mixprec.cli`` runs the ``mixprec`` command."""

import sys

from mixprec.cli import main

sys.exit(main())

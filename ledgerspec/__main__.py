import sys

from ledgerspec.faces.cli import main

sys.exit(main())

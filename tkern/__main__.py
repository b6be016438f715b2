import sys

from tkern.cli import main

sys.exit(main())

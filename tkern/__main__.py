import sys

from tkern.train.cli import main

sys.exit(main())

import sys

from mpzero.gpu_check.cli import main

sys.exit(main())

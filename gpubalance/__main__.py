import sys

from gpubalance.cli import main

sys.exit(main())

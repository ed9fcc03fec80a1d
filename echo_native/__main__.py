import sys

from echo_native.cli import main

sys.exit(main())

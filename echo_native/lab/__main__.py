"""``python -m echo_native.lab bench|make-dataset|demo`` (the same as ``echo-native-lab``)."""
import sys

from echo_native.lab.cli import main

sys.exit(main())

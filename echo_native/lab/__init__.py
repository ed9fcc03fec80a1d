"""The lab: tooling that measures and demonstrates the library, never used by it.

- :mod:`~echo_native.lab.corpus`: the built-in ImageNet-like benchmark corpus;
- :mod:`~echo_native.lab.datasets`: data-set builders (Fashion-MNIST as JPEG files);
- :mod:`~echo_native.lab.peers`: the torch DataLoader peer, run side by side;
- :mod:`~echo_native.lab.demo`: the echo training demo;
- :mod:`~echo_native.lab.cli`: the ``echo-native-lab`` command line (bench, make-dataset,
  demo; also ``python -m echo_native.lab``);
- ``_bench``: the libjpeg-turbo ROI-decode ceiling, in C.

The lab imports the library; the library never imports the lab.
"""

"""Helpers shared by the library's and the lab's command-line tests."""
from __future__ import annotations


def cli_error(main, prog, capsys, argv, *needles):
    """Runs ``main(argv)``; asserts exit 2 and one '<prog>: error:' line holding ``needles``
    (no traceback); returns that line."""
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) >= 1
    line = err[-1]
    assert line.startswith(f"{prog}: error: "), err
    assert "Traceback" not in "\n".join(err)
    for n in needles:
        assert n in line, line
    return line

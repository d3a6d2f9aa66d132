"""The ``ckpt`` console script: the Rust CLI, compiled into the extension, run in this
process with the same arguments and exit codes as the ``ckpt`` binary."""

import signal
import sys


def main() -> None:
    from ckpt import _ckpt

    # The CLI dies quietly on a closed pipe (`ckpt inspect big | head`), as the binary
    # does; Python ignores SIGPIPE by default.
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.stdout.flush()
    sys.exit(_ckpt.cli_main(["ckpt", *sys.argv[1:]]))


if __name__ == "__main__":
    main()

"""``python -m ckpt ...`` is the ``ckpt`` command."""

from ckpt._cli import main

main()

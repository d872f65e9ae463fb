"""``python -m mtmoe``: :func:`mtmoe.cli.main`; Ctrl-C while the command line loads is the one line it gives later."""
import signal
import sys

try:
    from mtmoe.cli import main
except KeyboardInterrupt:
    print("error: interrupted (Ctrl-C)", file=sys.stderr)
    sys.exit(128 + signal.SIGINT)

main()

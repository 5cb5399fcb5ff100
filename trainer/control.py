"""Ask a running job for a checkpoint, a drain or a new plan of its periods, over its control endpoint.

    python -m trainer.control RUN_DIR checkpoint|drain|replan [--url URL]

RUN_DIR is the run's local directory on the machine of its process 0 (a pod's mirror of a gs:// run:
`kubectl exec` into it): the token and the port are read from RUN_DIR/control/ (written there by a run
with metrics_port set; trainer.observe.control). `--url` reaches the endpoint elsewhere (a port-forward);
by default http://127.0.0.1:PORT. Prints the endpoint's answer. Exit codes: 0 accepted (acted on at the
next step boundary), 2 bad input (no such run directory, or one that serves no control endpoint),
1 refused or unreachable.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

from trainer.errors import EXIT_BAD_INPUT, EXIT_FAILED
from trainer.observe.control import ACTIONS, CONTROL_DIR, PATH, read_access

EXIT_REFUSED = EXIT_FAILED
TIMEOUT_S = 30.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.control", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the run directory (process 0's local one)")
    parser.add_argument("action", choices=ACTIONS)
    parser.add_argument("--url", default="", help="the endpoint, e.g. http://localhost:9491 (default: RUN_DIR's)")
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        print(f"error: no run directory {args.run_dir}: give the directory a run writes to", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        token, port = read_access(args.run_dir)
    except (FileNotFoundError, ValueError):
        print(
            f"error: {args.run_dir / CONTROL_DIR} holds no token and port: the run is not training, or it "
            "runs without metrics_port (start it with metrics_port=N), or this is not process 0's machine",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    base = (args.url or f"http://127.0.0.1:{port}").rstrip("/")
    request = urllib.request.Request(
        base + PATH + args.action, data=b"", method="POST", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            answer = json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as e:
        print(f"refused ({e.code}): {_message(e.read())}", file=sys.stderr)
        return EXIT_REFUSED
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        print(f"error: cannot reach {base} ({reason}): is the run still training?", file=sys.stderr)
        return EXIT_REFUSED
    print(f"accepted: {answer.get('message', args.action)}")
    return 0


def _message(body: bytes) -> str:
    try:
        return str(json.loads(body).get("message", ""))
    except (ValueError, AttributeError):
        return body.decode(errors="replace")[:500]


if __name__ == "__main__":
    sys.exit(main())

"""Regenerates the Python stubs in this package from proto/noloco/v1/*.proto, reproducibly.

``python -m noloco_node.wire.generate`` rewrites the committed stubs; ``--check`` exits 1 if they differ from
what the .proto files generate now (CI runs that through a test). protoc emits ``from noloco.v1 import ...``; the
stubs live in ``noloco_node.wire`` (the messages are the wire format), so that import is rewritten, and nothing
else is touched.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
PROTO_ROOT = PACKAGE_DIR.parent.parent / "proto"
PROTO_FILES = ("noloco/v1/peer.proto",)


def generate() -> dict[str, str]:
    """File name -> content of every generated stub."""
    from grpc_tools import protoc  # a dev dependency: only needed to regenerate

    with tempfile.TemporaryDirectory() as out:
        args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}"]
        if protoc.main([*args, *PROTO_FILES]) != 0:
            raise RuntimeError("protoc failed")
        generated = {}
        for path in sorted(Path(out, "noloco", "v1").iterdir()):
            text = path.read_text().replace("from noloco.v1 import", "from noloco_node.wire import")
            generated[path.name] = text
    return generated


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed stubs are out of date")
    args = parser.parse_args(argv)
    stale = []
    for name, content in generate().items():
        target = PACKAGE_DIR / name
        if not target.exists() or target.read_text() != content:
            stale.append(name)
            if not args.check:
                target.write_text(content)
    if args.check and stale:
        print(f"stubs out of date: {', '.join(stale)}; run python -m noloco_node.wire.generate", file=sys.stderr)
        return 1
    print("stubs " + ("up to date" if not stale else f"regenerated: {', '.join(stale)}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

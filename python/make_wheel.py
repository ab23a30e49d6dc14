"""Writes the zeroshard wheel (PEP 427) from the built package, without network or
build backends: the package files, the dist-info (METADATA, WHEEL, entry_points.txt
registering the torchrun rendezvous handler, RECORD with sha256 digests).

    make_wheel.py OUT.whl VERSION TAG PACKAGE_ROOT FILE...

PACKAGE_ROOT is the directory the FILEs' archive names are relative to (the site
directory holding zeroshard/). _native.so links the system's gRPC, protobuf and Abseil
dynamically: the wheel installs on machines with the libraries tools/install_deps.sh
installs (Debian 12)."""
import base64
import hashlib
import os
import sys
import zipfile

ENTRY_POINTS = """[torchrun.handlers]
zeroshard = zeroshard.torchrun_entry:handler_factory
"""


def digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def main(out: str, version: str, tag: str, root: str, *files: str) -> None:
    info = f"zeroshard-{version}.dist-info"
    entries = []
    for path in sorted(files):
        with open(path, "rb") as f:
            entries.append((os.path.relpath(path, root), f.read()))
    entries.append((f"{info}/METADATA", (
        f"Metadata-Version: 2.1\nName: zeroshard\nVersion: {version}\n"
        f"Summary: zeroshard's client and PyTorch bridge (FSDP2 checkpoints, torchrun "
        f"rendezvous)\nRequires-Python: >=3.11\n").encode()))
    entries.append((f"{info}/WHEEL", (
        f"Wheel-Version: 1.0\nGenerator: zeroshard make_wheel.py\nRoot-Is-Purelib: false\n"
        f"Tag: {tag}\n").encode()))
    entries.append((f"{info}/entry_points.txt", ENTRY_POINTS.encode()))
    record = "".join(f"{name},{digest(data)},{len(data)}\n" for name, data in entries)
    record += f"{info}/RECORD,,\n"
    entries.append((f"{info}/RECORD", record.encode()))
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in entries:
            zi = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))  # reproducible
            zi.external_attr = 0o644 << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(zi, data)


if __name__ == "__main__":
    main(*sys.argv[1:])

#!/usr/bin/env python
"""Carry an AWQ NVFP4 base of Gemma 3 270M to the device in one transfer, without its embedding.

The AWQ NVFP4 base that ``qerl compare`` makes (``qerl_cli.compare.bases._awq_base``) needs
llm-compressor, which is not on the device; it is made on the CPU machine instead. Its
``model.embed_tokens.weight`` (262144 x 640 BF16, 335 MB: tied to the output head, not quantized and
left as it is by AWQ) is most of the folder, and so is ``tokenizer.json`` (33 MB); both are the same
as in the BF16 folder qerl converts from the same GGUF, which the device makes itself. So:

``pack`` (here): the complete folder in, a small folder out: every other tensor in one gzipped
safetensors per shard, the small files as they are, and ``assemble.json`` with the SHA-256 of every
tensor and file, and which tensors/files are taken from the BF16 folder (``pack`` checks they are
equal there).

``assemble`` (on the device): the packed folder and the device's own BF16 conversion in, the complete
folder out (written staged, marked complete as qerl's bases are). Borrowed tensors must match the
recorded dtype, shape and SHA-256 before anything is written; every tensor of the result is checked
against its recorded SHA-256 after, and each safetensors file is reported byte-identical or not.

    python scripts/device_gemma_awq_assemble.py pack /work/gemma-awq/nvfp4-awq BF16_FOLDER .device/gemma-awq
    python scripts/device_gemma_awq_assemble.py assemble .device/gemma-awq gemma3-270m /tmp/nvfp4-awq

``BF16`` is a folder, or anything ``qerl_cli.modeling.sources.resolve_model_source`` takes (the
``gemma3-270m`` alias with ``QERL_CACHE_DIR`` holding the chunk wheels). Needs torch and safetensors.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load as load_bytes
from safetensors.torch import save, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qerl_cli.files import sha256_file  # noqa: E402 - after the checkout is on the path

MANIFEST = "assemble.json"
BORROWED_TENSORS = ("model.embed_tokens.weight",)
BORROW_FILES_OVER = 1 << 20  # files at least this large, byte-identical in the BF16 folder, are borrowed
SKIPPED_FILES = (".qerl-complete",)  # written again by the staged write


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tensor_sha256(tensor: torch.Tensor) -> str:
    """SHA-256 of the tensor's bytes as safetensors stores them (little-endian, C order)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return _sha256_bytes(flat.numpy().tobytes())


def _describe(tensor: torch.Tensor) -> dict[str, Any]:
    return {"dtype": str(tensor.dtype), "shape": list(tensor.shape), "sha256": _tensor_sha256(tensor)}


def _safetensors_metadata(path: Path) -> dict[str, str] | None:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata()


def _bf16_folder(ref: str) -> Path:
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    from qerl_cli.modeling.sources import resolve_model_source

    return Path(resolve_model_source(ref))


def _find_tensor(folder: Path, name: str) -> torch.Tensor:
    """``name`` from whichever safetensors file of ``folder`` holds it."""
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            if name in f.keys():  # noqa: SIM118 - safe_open handles are not dicts
                return f.get_tensor(name)
    raise SystemExit(f"{folder} has no tensor {name} in its safetensors files")


def pack(full: Path, bf16: Path, parts: Path, borrow: tuple[str, ...]) -> dict[str, Any]:
    """Write the packed form of the complete folder ``full`` into ``parts``."""
    if parts.exists():
        shutil.rmtree(parts)
    parts.mkdir(parents=True)
    manifest: dict[str, Any] = {"source": str(full), "safetensors": {}, "files": {}, "borrowed_files": {}}
    for file in sorted(full.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
        borrowed = {}
        for name in borrow:
            if name not in tensors:
                continue
            own = tensors.pop(name)
            theirs = _find_tensor(bf16, name)
            if own.dtype != theirs.dtype or own.shape != theirs.shape or not torch.equal(own, theirs):
                raise SystemExit(f"{name} in {file} differs from {bf16}'s: it cannot be borrowed")
            borrowed[name] = _describe(own)
        rest_name = f"{file.name}.rest.gz"
        metadata = _safetensors_metadata(file)
        with gzip.GzipFile(parts / rest_name, "wb", compresslevel=9, mtime=0) as out:
            out.write(save(tensors, metadata=metadata))
        manifest["safetensors"][file.name] = {
            "sha256": sha256_file(file),
            "metadata": metadata,
            "rest": rest_name,
            "borrowed": borrowed,
            "tensors": {key: _describe(t) for key, t in tensors.items()} | borrowed,
        }
    for file in sorted(p for p in full.iterdir() if p.is_file()):
        if file.suffix == ".safetensors" or file.name in SKIPPED_FILES:
            continue
        digest = sha256_file(file)
        twin = bf16 / file.name
        if file.stat().st_size >= BORROW_FILES_OVER and twin.is_file() and sha256_file(twin) == digest:
            manifest["borrowed_files"][file.name] = digest
        else:
            shutil.copy2(file, parts / file.name)
            manifest["files"][file.name] = digest
    (parts / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _check_tensor(name: str, tensor: torch.Tensor, want: dict[str, Any], where: str) -> None:
    got = {"dtype": str(tensor.dtype), "shape": list(tensor.shape)}
    if got != {"dtype": want["dtype"], "shape": want["shape"]}:
        raise SystemExit(f"{name} from {where} is {got}, expected {want['dtype']} {want['shape']}")
    if _tensor_sha256(tensor) != want["sha256"]:
        raise SystemExit(f"{name} from {where} has the right shape and dtype but other values")


def assemble(parts: Path, bf16: Path, target: Path, strict: bool, overwrite: bool) -> dict[str, Any]:
    """The complete folder in ``target`` from ``parts`` and the BF16 folder ``bf16``."""
    from qerl_cli.files import is_complete_folder, write_folder_once

    manifest = json.loads((parts / MANIFEST).read_text())
    if target.exists():
        if not overwrite:
            raise SystemExit(f"{target} exists: remove it or pass --overwrite")
        shutil.rmtree(target)
    # Everything taken from the BF16 folder is checked before anything is written.
    borrowed: dict[str, torch.Tensor] = {}
    for entry in manifest["safetensors"].values():
        for name, want in entry["borrowed"].items():
            borrowed[name] = _find_tensor(bf16, name)
            _check_tensor(name, borrowed[name], want, str(bf16))
            print(f"{name}: {want['dtype']} {want['shape']} from {bf16}, SHA-256 matches", flush=True)
    file_notes = {}
    for name, digest in manifest["borrowed_files"].items():
        twin = bf16 / name
        if not twin.is_file():
            raise SystemExit(f"{bf16} has no {name}")
        same = sha256_file(twin) == digest
        if not same and strict:
            raise SystemExit(f"{twin} differs from the packed model's {name} (--strict)")
        file_notes[name] = "identical" if same else "DIFFERS (taken from the BF16 folder anyway)"
        print(f"{name} from {bf16}: {file_notes[name]}", flush=True)

    report: dict[str, Any] = {"target": str(target), "safetensors": {}, "files": file_notes}

    def write(staging: Path) -> None:
        for file_name, entry in manifest["safetensors"].items():
            with gzip.open(parts / entry["rest"], "rb") as f:
                tensors = load_bytes(f.read())
            tensors.update({name: borrowed[name] for name in entry["borrowed"]})
            if set(tensors) != set(entry["tensors"]):
                raise SystemExit(f"{file_name}: tensor names differ from the manifest's")
            out = staging / file_name
            save_file(tensors, str(out), metadata=entry["metadata"])
            del tensors
            with safe_open(str(out), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118
                    _check_tensor(name, f.get_tensor(name), entry["tensors"][name], str(out))
            identical = sha256_file(out) == entry["sha256"]
            report["safetensors"][file_name] = {
                "tensors": len(entry["tensors"]),
                "tensors_verified": True,
                "file_byte_identical": identical,
            }
            print(f"{file_name}: {len(entry['tensors'])} tensors verified, file byte-identical: {identical}")
        for name, digest in manifest["files"].items():
            shutil.copy2(parts / name, staging / name)
            if sha256_file(staging / name) != digest:
                raise SystemExit(f"{parts / name} does not match its recorded SHA-256")
        for name in manifest["borrowed_files"]:
            shutil.copy2(bf16 / name, staging / name)

    write_folder_once(target, write)
    report["complete"] = is_complete_folder(target)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="complete folder -> packed folder (here)")
    p.add_argument("full", type=Path, help="the complete AWQ NVFP4 folder")
    p.add_argument("bf16", help="the BF16 folder it was quantized from (or a qerl model alias)")
    p.add_argument("parts", type=Path, help="where the packed folder goes (replaced)")
    p.add_argument("--borrow", nargs="+", default=list(BORROWED_TENSORS), help="tensors left out")
    a = sub.add_parser("assemble", help="packed folder + BF16 folder -> complete folder (on the device)")
    a.add_argument("parts", type=Path, help="the packed folder (with assemble.json)")
    a.add_argument("bf16", help="the device's BF16 conversion of the same GGUF (folder or qerl model alias)")
    a.add_argument("target", type=Path, help="the complete folder to write")
    a.add_argument("--strict", action="store_true", help="also fail when a borrowed file (tokenizer) differs")
    a.add_argument("--overwrite", action="store_true", help="replace an existing target")
    args = parser.parse_args(argv)
    bf16 = _bf16_folder(args.bf16)
    if args.command == "pack":
        manifest = pack(args.full, bf16, args.parts, tuple(args.borrow))
        size = sum(p.stat().st_size for p in args.parts.iterdir())
        borrowed = [n for e in manifest["safetensors"].values() for n in e["borrowed"]]
        print(
            f"packed {args.full} into {args.parts}: {size / 1e6:.1f} MB; borrowed tensors {borrowed}, "
            f"files {sorted(manifest['borrowed_files'])}"
        )
    else:
        report = assemble(args.parts, bf16, args.target, args.strict, args.overwrite)
        print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

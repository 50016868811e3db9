"""data=imagefolder: each split's class folders listed and its files fingerprinted in a helper
process that runs beside the set-up's imports.

Listing 60,000 files (torchvision's ImageFolder) and stat-ing each for the decode cache's
fingerprint took 0.19 + 0.38 s on one H100 host, in the main thread after dynamo's and
inductor's imports (README, "From Enter to result"). A thread cannot take it over: each stat
lets go of Python's lock, and a thread that wants it back while the main thread imports waits
the switch interval (5 ms) for each file. A process of the standard library alone
(`python -I -S`, tens of milliseconds to start) does it on another core. ImageFolder itself
cannot run there (torchvision imports torch), so its rules are kept here, and
tests/test_listing.py holds them against ImageFolder's own: class folders sorted (symlinks to
folders count), each walked with links followed, folders and files sorted, files kept by
IMG_EXTENSIONS (case-insensitive), a split without classes or a class without files refused.
Whatever the helper cannot answer (a missing folder, a refused layout, no interpreter to start)
is left to ImageFolder in the main process, whose errors the run reports.

Owns: the listing and the fingerprint (one definition; imagefolder.py uses it).
Must not touch: decoding and the cache file (imagefolder.py, decode_cache.py). Imports the
standard library only: it runs as a script in an interpreter without site-packages.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

# torchvision.datasets.folder.IMG_EXTENSIONS, as ImageFolder keeps files by them
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def fingerprint(folder: str, samples: list[tuple[str, int]], image_size: int) -> str:
    """Changes when any file is added, removed, renamed, relabelled, resized or touched."""
    digest = hashlib.sha1(f"{image_size}".encode())
    prefix = os.path.join(folder, "")  # ImageFolder's paths start with it: cut, not os.path.relpath
    for path, label in samples:
        stat = os.stat(path)
        name = path[len(prefix) :] if path.startswith(prefix) else os.path.relpath(path, folder)
        digest.update(f"{name}\t{label}\t{stat.st_size}\t{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def list_split(folder: str) -> tuple[list[str], list[tuple[str, int]]] | None:
    """(classes, samples) as ImageFolder(folder) has them, or None where it would refuse."""
    classes = sorted(entry.name for entry in os.scandir(folder) if entry.is_dir())
    samples = []
    for label, name in enumerate(classes):
        found = len(samples)
        for place, _, files in sorted(os.walk(os.path.join(folder, name), followlinks=True)):
            samples.extend(
                (os.path.join(place, file), label)
                for file in sorted(files)
                if file.lower().endswith(IMG_EXTENSIONS)
            )
        if len(samples) == found:
            return None
    return (classes, samples) if classes else None


def answer(root: str, splits: list[str], image_size: int | None) -> dict:
    """{split: {"classes", "samples", "fingerprint"}} (fingerprint None when not asked for);
    {} where a split cannot be listed here."""
    listed = {}
    for split in splits:
        folder = os.path.join(root, split)
        try:
            found = list_split(folder)
        except OSError:
            return {}
        if found is None:
            return {}
        classes, samples = found
        wanted = image_size is not None
        listed[split] = {
            "classes": classes,
            "samples": samples,
            "fingerprint": fingerprint(folder, samples, image_size) if wanted else None,
        }
    return listed


class ListingAhead:
    """The helper process, started at once; `result()` waits for its answer."""

    def __init__(self, root: str, splits: tuple[str, ...], image_size: int | None):
        command = [sys.executable, "-I", "-S", __file__, root, str(image_size or 0), *splits]
        try:
            self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        except OSError:  # no interpreter to start (an embedded one): the main process lists
            self.process = None

    def result(self) -> dict:
        """As `answer`, {} where the helper failed."""
        if self.process is None:
            return {}
        output, _ = self.process.communicate()
        process, self.process = self.process, None
        if process.returncode != 0:
            return {}
        return {
            split: {**found, "samples": [tuple(sample) for sample in found["samples"]]}
            for split, found in json.loads(output).items()
        }

    def __del__(self) -> None:
        """Never asked for (a set-up that failed before the data): the helper is not left behind,
        blocked on a pipe nobody reads."""
        process = getattr(self, "process", None)
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()


if __name__ == "__main__":
    size = int(sys.argv[2])
    json.dump(answer(sys.argv[1], sys.argv[3:], size or None), sys.stdout)

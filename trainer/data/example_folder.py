"""`python -m trainer.data.example_folder --out DIR`: a small image folder for a first look.

Writes the synthetic images (`data=synthetic`: a learnable pattern per class plus noise) as
PNG files in the class-folder layout that `data=imagefolder` reads, DIR/train/<class>/*.png
and DIR/test/<class>/*.png, so the file-decoding path can be tried on a machine that cannot
download CIFAR-10:

    python -m trainer.data.example_folder --out example-images
    python -m trainer model=cnn data=imagefolder data.root=example-images epochs=2

Any copy of CIFAR-10 (or another 32x32 RGB set) in the same layout serves the same way. An
existing DIR/train or DIR/test is never written into.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROG = "python -m trainer.data.example_folder"


def write_folder(out: Path, train: int, test: int, seed: int) -> None:
    from PIL import Image

    from trainer.data.sources import synthetic_split

    for name, size, is_train in (("train", train, True), ("test", test, False)):
        split = synthetic_split(size, train=is_train, seed=seed)
        for index, (image, label) in enumerate(zip(split.images, split.labels.tolist())):
            folder = out / name / f"class{label}"
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image.permute(1, 2, 0).numpy()).save(folder / f"{index:05d}.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="the folder to write train/ and test/ into")
    parser.add_argument("--train", type=int, default=2000, help="training images (default 2000)")
    parser.add_argument("--test", type=int, default=500, help="test images (default 500)")
    parser.add_argument("--seed", type=int, default=0, help="the synthetic set's seed (default 0)")
    args = parser.parse_args(argv)
    taken = [name for name in ("train", "test") if (args.out / name).exists()]
    problem = None
    if args.train < 100 or args.test < 100:
        problem = "--train and --test must be at least 100, so that every class has images in both"
    elif taken:
        problem = f"{args.out} already has {' and '.join(taken)}/: pick another --out"
    if problem:
        print(f"example_folder: error: {problem}", file=sys.stderr)
        return 2
    try:
        write_folder(args.out, args.train, args.test, args.seed)
    except OSError as error:
        print(f"example_folder: error: could not write {error.filename} ({error.strerror})", file=sys.stderr)
        return 1
    print(f"wrote {args.train} training and {args.test} test images: data=imagefolder data.root={args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

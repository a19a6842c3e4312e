"""Readers for real data on disk: captions, zero-shot classes, taxonomies and boxes.

Every reader returns plain Python lists (paths, strings, indices); encoding happens in
``curvalign.data.extract``. A malformed file raises :class:`ReaderError` naming the file and
the line or key that broke the expected layout.

Layouts
-------
COCO captions (``captions_train2017.json``)::

    {"images": [{"id": 1, "file_name": "a.jpg"}, ...],
     "annotations": [{"image_id": 1, "caption": "a dog"}, ...]}

Karpathy split (``dataset_coco.json``, ``dataset_flickr30k.json``)::

    {"images": [{"filepath": "val2014", "filename": "b.jpg", "split": "test",
                 "sentences": [{"raw": "a cat"}, ...]}, ...]}

    ``filepath`` is optional; ``restval`` is read as ``train`` (the split's usual reading).

Zero-shot classes (the CLIP_benchmark files): an image folder with one sub-folder per class
(sorted folder names give the class order, as in torchvision's ImageFolder), a classnames
file and a templates file. Either file is a JSON list, a JSON object mapping dataset names
to lists (``en_classnames.json``, ``en_zeroshot_classification_templates.json``; the images
folder's name, or the only key, picks the list), or a text file with one entry per line.
Templates hold ``{c}`` where the class name goes.

Taxonomy edge list (ImageNet's ``wordnet.is_a.txt``): one ``parent child`` pair of node ids
per line; ``#`` starts a comment. A node listed under several parents keeps the first one
(the others are counted in ``Taxonomy.extra_parent_edges``, and reported).

Boxes (HyCoCLIP / PHyCLIP box-level pairs): JSON Lines, one box per line, or a JSON list of
the same objects::

    {"image": "a.jpg", "box": [x0, y0, x1, y1], "phrase": "a brown dog"}

    ``image`` is the image's path relative to the images folder (as in the captions file);
    ``box`` is in pixels, x0 < x1 and y0 < y1.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from curvalign.errors import CurvalignError

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")


class ReaderError(CurvalignError, ValueError):
    """A data file that does not have the expected layout."""


@dataclass
class CaptionedImages:
    """Images and their captions. ``caption_to_image[k]`` indexes ``image_files``."""

    image_files: list[str]  # relative to the images folder
    captions: list[str]
    caption_to_image: list[int]
    image_splits: list[str] | None = None  # one split name per image


@dataclass
class ClassFolder:
    """An image folder for zero-shot classification: images, their class, class prompts."""

    image_files: list[str]  # relative to the images folder
    image_labels: list[int]
    class_folders: list[str]  # the sub-folder names (e.g. WordNet ids)
    class_names: list[str]
    templates: list[str]

    def prompts(self) -> tuple[list[str], list[int]]:
        """(prompt texts, class of each prompt): every template for every class."""
        texts = [t.replace("{c}", name) for name in self.class_names for t in self.templates]
        owners = [c for c in range(len(self.class_names)) for _ in self.templates]
        return texts, owners


@dataclass
class Taxonomy:
    """A forest: ``parents[i]`` is the index of node i's parent, -1 for a root."""

    names: list[str]
    parents: list[int]
    extra_parent_edges: int = 0  # edges dropped to keep one parent per node

    def index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.names)}


@dataclass
class Box:
    image_file: str
    box: tuple[float, float, float, float]
    phrase: str


@dataclass
class Location:
    file: Path
    line: int | None = None
    keys: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        out = str(self.file)
        if self.line is not None:
            out += f": line {self.line}"
        if self.keys:
            out += ": " + "".join(f"[{k}]" if k.isdigit() else f".{k}" for k in self.keys).lstrip(
                "."
            )
        return out


def read_json(path: str | os.PathLike[str], what: str) -> Any:
    file = Path(path)
    if not file.is_file():
        raise ReaderError(f"{what} {file}: no such file")
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ReaderError(f"{what} {file}: not UTF-8 text ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ReaderError(
            f"{what} {file}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from None


def get_key(obj: Any, key: str, kind: type | tuple[type, ...], where: Location) -> Any:
    if not isinstance(obj, dict):
        raise ReaderError(f"{where}: expected an object with key {key!r}, got {type(obj).__name__}")
    if key not in obj:
        raise ReaderError(f"{where}: missing key {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ReaderError(
            f"{Location(where.file, where.line, [*where.keys, key])}: expected {names}, got {type(value).__name__}"
        )
    return value


def read_coco_captions(path: str | os.PathLike[str]) -> CaptionedImages:
    """COCO captions JSON -> images (in file order) and their captions (in file order).

    An image without any caption is kept (a gallery distractor); a caption whose image id is
    not listed under ``images`` is an error.
    """
    file = Path(path)
    data = read_json(file, "COCO captions file")
    top = Location(file)
    images = get_key(data, "images", list, top)
    annotations = get_key(data, "annotations", list, top)
    files: list[str] = []
    by_id: dict[Any, int] = {}
    for i, image in enumerate(images):
        where = Location(file, keys=["images", str(i)])
        image_id = get_key(image, "id", (int, str), where)
        if image_id in by_id:
            raise ReaderError(f"{where}: image id {image_id!r} appears twice")
        by_id[image_id] = len(files)
        files.append(get_key(image, "file_name", str, where))
    captions: list[str] = []
    owners: list[int] = []
    for i, annotation in enumerate(annotations):
        where = Location(file, keys=["annotations", str(i)])
        image_id = get_key(annotation, "image_id", (int, str), where)
        if image_id not in by_id:
            raise ReaderError(f"{where}: image_id {image_id!r} is not listed under 'images'")
        captions.append(get_key(annotation, "caption", str, where).strip())
        owners.append(by_id[image_id])
    return CaptionedImages(files, captions, owners)


def read_karpathy(path: str | os.PathLike[str]) -> CaptionedImages:
    """Karpathy split JSON -> images with their split and several captions each."""
    file = Path(path)
    data = read_json(file, "Karpathy split file")
    images = get_key(data, "images", list, Location(file))
    files: list[str] = []
    splits: list[str] = []
    captions: list[str] = []
    owners: list[int] = []
    for i, image in enumerate(images):
        where = Location(file, keys=["images", str(i)])
        name = get_key(image, "filename", str, where)
        folder = image.get("filepath", "") if isinstance(image, dict) else ""
        if not isinstance(folder, str):
            raise ReaderError(
                f"{Location(file, keys=['images', str(i), 'filepath'])}: expected str"
            )
        split = get_key(image, "split", str, where)
        sentences = get_key(image, "sentences", list, where)
        for j, sentence in enumerate(sentences):
            raw = get_key(
                sentence, "raw", str, Location(file, keys=["images", str(i), "sentences", str(j)])
            )
            captions.append(raw.strip())
            owners.append(len(files))
        files.append(f"{folder}/{name}" if folder else name)
        splits.append("train" if split == "restval" else split)
    return CaptionedImages(files, captions, owners, splits)


def read_captions(path: str | os.PathLike[str], layout: str | None = None) -> CaptionedImages:
    """Either caption layout; ``layout=None`` tells them apart by their keys."""
    if layout == "coco":
        return read_coco_captions(path)
    if layout == "karpathy":
        return read_karpathy(path)
    if layout is not None:
        raise ReaderError(f"captions format {layout!r}: expected 'coco' or 'karpathy'")
    data = read_json(path, "captions file")
    if isinstance(data, dict) and "annotations" in data:
        return read_coco_captions(path)
    if isinstance(data, dict) and "images" in data:
        return read_karpathy(path)
    raise ReaderError(
        f"captions file {path}: neither COCO ('images' and 'annotations') nor Karpathy ('images' with 'sentences')"
    )


def read_string_list(path: str | os.PathLike[str], what: str, dataset: str | None) -> list[str]:
    file = Path(path)
    if file.suffix.lower() != ".json":
        if not file.is_file():
            raise ReaderError(f"{what} {file}: no such file")
        lines = [line.strip() for line in file.read_text(encoding="utf-8").splitlines()]
        entries = [line for line in lines if line]
    else:
        data = read_json(file, what)
        if isinstance(data, dict):
            if dataset in data:
                data = data[dataset]
            elif len(data) == 1:
                data = next(iter(data.values()))
            else:
                raise ReaderError(
                    f"{what} {file}: an object with several datasets ({', '.join(sorted(data)[:5])}, ...) "
                    f"and none named {dataset!r} (the images folder's name)"
                )
        if not isinstance(data, list) or not all(isinstance(s, str) for s in data):
            raise ReaderError(f"{what} {file}: expected a JSON list of strings")
        entries = [s.strip() for s in data]
    if not entries:
        raise ReaderError(f"{what} {file}: empty")
    return entries


def read_class_folder(
    images: str | os.PathLike[str],
    classnames: str | os.PathLike[str],
    templates: str | os.PathLike[str],
) -> ClassFolder:
    """An image folder with one sub-folder per class, plus CLIP_benchmark class names and templates."""
    root = Path(images)
    if not root.is_dir():
        raise ReaderError(f"images folder {root}: no such directory")
    folders = sorted(p.name for p in root.iterdir() if p.is_dir())
    if not folders:
        raise ReaderError(f"images folder {root}: expected one sub-folder per class, found none")
    names = read_string_list(classnames, "classnames file", root.name)
    if len(names) != len(folders):
        raise ReaderError(
            f"classnames file {classnames}: {len(names)} names for {len(folders)} class folders in {root} "
            "(the names follow the sorted folder names)"
        )
    prompt_templates = read_string_list(templates, "templates file", root.name)
    for i, template in enumerate(prompt_templates):
        if "{c}" not in template:
            raise ReaderError(
                f"templates file {templates}: entry {i} {template!r} has no '{{c}}' for the class name"
            )
    files: list[str] = []
    labels: list[int] = []
    for c, folder in enumerate(folders):
        for p in sorted((root / folder).rglob("*")):
            if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES:
                files.append(p.relative_to(root).as_posix())
                labels.append(c)
    return ClassFolder(files, labels, folders, names, prompt_templates)


def read_edge_list(path: str | os.PathLike[str]) -> Taxonomy:
    """``parent child`` lines (ImageNet is-a format) -> a forest over every id named."""
    file = Path(path)
    if not file.is_file():
        raise ReaderError(f"taxonomy file {file}: no such file")
    names: list[str] = []
    index: dict[str, int] = {}
    parent_of: dict[int, int] = {}
    extra = 0

    def node(name: str) -> int:
        if name not in index:
            index[name] = len(names)
            names.append(name)
        return index[name]

    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        parts = text.split()
        if len(parts) != 2:
            raise ReaderError(
                f"taxonomy file {file}: line {number}: expected 'parent child', got {line.strip()!r}"
            )
        parent, child = node(parts[0]), node(parts[1])
        if parent == child:
            raise ReaderError(
                f"taxonomy file {file}: line {number}: {parts[0]!r} is its own parent"
            )
        if child in parent_of:
            extra += int(parent_of[child] != parent)
            continue
        parent_of[child] = parent
    if not names:
        raise ReaderError(f"taxonomy file {file}: no 'parent child' lines")
    parents = [parent_of.get(i, -1) for i in range(len(names))]
    _check_acyclic(parents, names, f"taxonomy file {file}")
    return Taxonomy(names, parents, extra)


def _check_acyclic(parents: list[int], names: list[str], what: str) -> None:
    state = [0] * len(parents)  # 0 unseen, 1 on the current walk, 2 reaches a root
    for start in range(len(parents)):
        walk = []
        node = start
        while node != -1 and state[node] == 0:
            state[node] = 1
            walk.append(node)
            node = parents[node]
        if node != -1 and state[node] == 1:
            raise ReaderError(f"{what}: the parent links form a cycle through {names[node]!r}")
        for n in walk:
            state[n] = 2


def taxonomy_with_ancestors(
    taxonomy: Taxonomy, keep: Iterable[str]
) -> tuple[Taxonomy, dict[str, int]]:
    """The sub-forest of ``keep`` and all their ancestors; returns it and a name -> node map."""
    index = taxonomy.index()
    wanted: set[int] = set()
    for name in keep:
        node = index.get(name, -2)
        if node == -2:
            continue
        while node != -1 and node not in wanted:
            wanted.add(node)
            node = taxonomy.parents[node]
    order = sorted(wanted)
    new = {old: i for i, old in enumerate(order)}
    names = [taxonomy.names[o] for o in order]
    parents = [new.get(taxonomy.parents[o], -1) for o in order]
    return Taxonomy(names, parents, taxonomy.extra_parent_edges), {
        n: i for i, n in enumerate(names)
    }


def read_boxes(path: str | os.PathLike[str]) -> list[Box]:
    """Box-level pairs from JSON Lines (or a JSON list); see the module docstring."""
    file = Path(path)
    if not file.is_file():
        raise ReaderError(f"boxes file {file}: no such file")
    text = file.read_text(encoding="utf-8")
    records: list[tuple[Location, Any]] = []
    if text.lstrip().startswith("["):
        data = read_json(file, "boxes file")
        records = [(Location(file, keys=[str(i)]), item) for i, item in enumerate(data)]
    else:
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append((Location(file, line=number), json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ReaderError(
                    f"boxes file {file}: line {number}: not a JSON object ({exc.msg})"
                ) from None
    boxes: list[Box] = []
    for where, item in records:
        image = get_key(item, "image", str, where)
        phrase = get_key(item, "phrase", str, where).strip()
        raw = get_key(item, "box", list, where)
        if len(raw) != 4 or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in raw
        ):
            raise ReaderError(f"{where}: 'box' must be four numbers [x0, y0, x1, y1], got {raw!r}")
        x0, y0, x1, y1 = (float(v) for v in raw)
        if not (x0 < x1 and y0 < y1):
            raise ReaderError(f"{where}: 'box' needs x0 < x1 and y0 < y1, got {raw!r}")
        if not phrase:
            raise ReaderError(f"{where}: 'phrase' is empty")
        boxes.append(Box(image, (x0, y0, x1, y1), phrase))
    return boxes


@dataclass
class TextPairs:
    """Scored text pairs (DualPath): ``scores[k]`` in [0, 1] says how alike ``a[k]`` and ``b[k]`` are."""

    a: list[str]
    b: list[str]
    scores: list[float]


def read_text_pairs(path: str | os.PathLike[str], score_max: float = 1.0) -> TextPairs:
    """Scored text pairs from JSON Lines ``{"a": ..., "b": ..., "score": ...}`` (or a JSON list of
    them) or a TSV file ``a<TAB>b<TAB>score`` (STS-B style; a header line without a numeric
    score is skipped). Scores are divided by ``score_max`` (5 for STS-B) and must then lie in
    [0, 1]."""
    file = Path(path)
    if not file.is_file():
        raise ReaderError(f"text pairs file {file}: no such file")
    if not score_max > 0:
        raise ReaderError(f"score_max must be positive, got {score_max}")
    text = file.read_text(encoding="utf-8")
    a: list[str] = []
    b: list[str] = []
    scores: list[float] = []
    rows = (
        _tsv_text_pairs(file, text)
        if file.suffix.lower() in (".tsv", ".txt")
        else _json_text_pairs(file, text)
    )
    for where, first, second, score in rows:
        if not isinstance(first, str) or not isinstance(second, str):
            raise ReaderError(f"{where}: the two texts must be strings")
        a.append(first.strip())
        b.append(second.strip())
        scores.append(_pair_score(where, score, score_max))
    if not a:
        raise ReaderError(f"text pairs file {file}: no pairs")
    return TextPairs(a, b, scores)


_PairRow = tuple[Location, Any, Any, Any]  # where, text a, text b, raw score


def _pair_score(where: Location, score: Any, score_max: float) -> float:
    """``score / score_max``, which must be a number in [0, 1]."""
    try:
        value = float(score) / score_max
    except (TypeError, ValueError):
        raise ReaderError(f"{where}: score {score!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        hint = "" if score_max != 1.0 else " (pass a score maximum, e.g. 5 for STS-B)"
        raise ReaderError(
            f"{where}: score {score!r} / {score_max:g} = {value:g} lies outside [0, 1]{hint}"
        )
    return value


def _tsv_text_pairs(file: Path, text: str) -> Iterator[_PairRow]:
    """Rows of ``a<TAB>b<TAB>score`` lines; blank lines and a non-numeric header are skipped."""
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != 3:
            raise ReaderError(
                f"text pairs file {file}: line {number}: expected 'a<TAB>b<TAB>score', "
                f"got {len(parts)} fields"
            )
        if number == 1 and not _is_number(parts[2]):
            continue  # a header
        yield Location(file, number), parts[0], parts[1], parts[2]


def _json_text_pairs(file: Path, text: str) -> Iterator[_PairRow]:
    """Rows of a JSON list or JSON Lines of ``{"a", "b", "score"}`` records (all parsed first)."""
    if text.lstrip().startswith("["):
        records = [
            (Location(file, keys=[str(i)]), r)
            for i, r in enumerate(read_json(file, "text pairs file"))
        ]
    else:
        records = []
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    records.append((Location(file, number), json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise ReaderError(
                        f"text pairs file {file}: line {number}: not JSON ({exc.msg})"
                    ) from None
    for where, record in records:
        yield (
            where,
            get_key(record, "a", str, where),
            get_key(record, "b", str, where),
            get_key(record, "score", (int, float), where),
        )


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def open_image(source: str | os.PathLike[str] | BinaryIO) -> PILImage:
    """A PIL RGB image from a path or a binary file object, decoded fully now, so a truncated
    file fails here and not inside the encoder (extract and the webdataset reader share it)."""
    from PIL import Image

    try:
        with Image.open(source) as image:
            image.load()
            return image.convert("RGB")
    except Image.DecompressionBombError as exc:  # not an OSError; report it like one
        raise ValueError(str(exc)) from None

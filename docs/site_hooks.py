"""mkdocs hooks for ``make docs``: the repository's front pages join the site.

README.md becomes the home page, ARCHITECTURE.md and BENCHMARKS.md pages of their own, so
that the site and the repository read the same text. Links are rewritten for where each page
lands: README's ``docs/x.md`` is ``x.md`` in the site, a docs page's ``../BENCHMARKS.md`` is
``BENCHMARKS.md``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
FRONT_PAGES = {
    "README.md": "index.md",
    "ARCHITECTURE.md": "ARCHITECTURE.md",
    "BENCHMARKS.md": "BENCHMARKS.md",
}


def on_files(files: Files, config: Any) -> Files:
    for source, name in FRONT_PAGES.items():
        files.append(File.generated(config, name, abs_src_path=str(ROOT / source)))
    return files


NOTEBOOK_LINK = re.compile(r"\[([^\]]*)\]\((?:\.\./)?(notebooks/[^)]*\.ipynb)\)")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if page.file.src_uri in FRONT_PAGES.values():  # written at the repository's root
        markdown = markdown.replace("](docs/", "](")
    else:
        markdown = markdown.replace("](../BENCHMARKS.md", "](BENCHMARKS.md")
        markdown = markdown.replace("](../ARCHITECTURE.md", "](ARCHITECTURE.md")
    # the notebooks are not pages of the site: name them where they lie in the repository
    return NOTEBOOK_LINK.sub(r"\1 (`\2`)", markdown)

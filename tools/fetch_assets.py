"""Fetch the JavaScript the static book serves itself, from the npm registry.

Usage: python tools/fetch_assets.py DEST PACKAGE@VERSION ...

Each package is downloaded with ``npm pack`` (the registry's ordinary client)
and unpacked into DEST/<name>. Nothing fetched here is committed: DEST lives
under _build/. The book's _config.yml points Sphinx at these files so that no
page loads anything from another host.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path


def fetch(dest: Path, spec: str) -> Path:
    name = spec.rsplit("@", 1)[0].split("/")[-1]
    target = dest / name
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(["npm", "pack", spec, "--silent", "--pack-destination", tmp],
                             check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        with tarfile.open(Path(tmp) / out) as tar:
            tar.extractall(tmp, filter="data")
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(Path(tmp) / "package", target)
    return target


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    if shutil.which("npm") is None:
        print("fetch_assets: npm is needed to fetch the widget manager, require.js and MathJax "
              "from the npm registry (Debian: apt-get install npm)", file=sys.stderr)
        return 1
    dest = Path(argv[0])
    dest.mkdir(parents=True, exist_ok=True)
    for spec in argv[1:]:
        path = fetch(dest, spec)
        print(f"fetched {spec} -> {path}")
    # The static folder Sphinx copies into _static/: only the files pages load.
    static = dest / "static"
    if static.exists():
        shutil.rmtree(static)
    static.mkdir()
    shutil.copy(dest / "html-manager" / "dist" / "embed-amd.js", static / "embed-amd.js")
    shutil.copy(dest / "requirejs" / "require.js", static / "require.js")
    # The fonts the widget manager's stylesheet asks for, beside the path that
    # _config.yml tells require.js the manager lives at.
    fonts = static / "html-manager"
    fonts.mkdir()
    for font in (dest / "html-manager" / "dist").iterdir():
        if font.suffix in {".woff2", ".woff", ".ttf", ".eot", ".svg"}:
            shutil.copy(font, fonts / font.name)
    # MathJax: the TeX-to-CHTML component, the extensions and fonts it loads on
    # demand, the accessibility and menu pieces; not the other bundles or the
    # speech-rule maps (which only a reader who turns speech on would request).
    es5 = dest / "mathjax" / "es5"
    mj = static / "mathjax"
    mj.mkdir()
    shutil.copy(es5 / "tex-chtml.js", mj / "tex-chtml.js")
    for sub in ["input/tex/extensions", "output/chtml/fonts/woff-v2", "a11y", "ui", "adaptors"]:
        if (es5 / sub).exists():
            shutil.copytree(es5 / sub, mj / sub)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Makes the pages `asv publish` writes work without internet.

asv's index.html loads jQuery, flot, bootstrap, stupidtable and md5 from CDNs; a machine that cannot
reach them (CI here) shows asv's error page instead of the benchmarks. This fetches the same libraries
from the npm registry with `npm pack`, copies the files asv needs into html/vendor/ and points
index.html at them. Usage: python perf/asv_offline.py results/asv/html
"""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

# File name as index.html loads it -> (npm package, path in the package's tarball). stupidtable is
# published on npm as stupid-table-plugin, whose oldest release (1.1.3) is the closest to cdnjs's 1.0.1.
VENDORED = {
    "jquery-3.3.1.min.js": ("jquery@3.3.1", "package/dist/jquery.min.js"),
    "jquery.flot.min.js": ("flot@0.8.3", "package/jquery.flot.js"),
    "jquery.flot.time.min.js": ("flot@0.8.3", "package/jquery.flot.time.js"),
    "jquery.flot.selection.min.js": ("flot@0.8.3", "package/jquery.flot.selection.js"),
    "jquery.flot.categories.min.js": ("flot@0.8.3", "package/jquery.flot.categories.js"),
    "jquery.flot.orderBars.js": ("flot-orderbars@1.0.0", "package/js/jquery.flot.orderBars.js"),
    "stupidtable.min.js": ("stupid-table-plugin@1.1.3", "package/stupidtable.min.js"),
    "md5.min.js": ("blueimp-md5@2.19.0", "package/js/md5.min.js"),
    "bootstrap.min.js": ("bootstrap@3.1.1", "package/dist/js/bootstrap.min.js"),
    "bootstrap.min.css": ("bootstrap@3.1.1", "package/dist/css/bootstrap.min.css"),
}

_CDN_TAG = re.compile(r'(src|href)="https://[^"]*/(?P<name>[^"/]+)"(?P<attrs>[^>]*)>')
_SRI = re.compile(r'\s+(integrity|crossorigin|referrerpolicy)="[^"]*"')


def vendor(html_dir: Path) -> None:
    index = html_dir / "index.html"
    page = index.read_text()
    names = {m.group("name") for m in _CDN_TAG.finditer(page)}
    unknown = names - set(VENDORED)
    if unknown:
        raise SystemExit(f"index.html loads {sorted(unknown)} from a CDN; add them to VENDORED in {__file__}")
    vendor_dir = html_dir / "vendor"
    vendor_dir.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for package in sorted({VENDORED[n][0] for n in names}):
            subprocess.run(["npm", "pack", "--silent", package], cwd=tmp, check=True, capture_output=True)
        for name in names:
            package, member = VENDORED[name]
            tarball = Path(tmp) / (package.rsplit("@", 1)[0] + "-" + package.rsplit("@", 1)[1] + ".tgz")
            with tarfile.open(tarball) as tar:
                (vendor_dir / name).write_bytes(tar.extractfile(member).read())

    def local(m: re.Match) -> str:
        # Subresource-integrity hashes are those of the CDN's minified builds, not of these copies.
        return f'{m.group(1)}="vendor/{m.group("name")}"{_SRI.sub("", m.group("attrs"))}>'

    index.write_text(_CDN_TAG.sub(local, page))


if __name__ == "__main__":
    vendor(Path(sys.argv[1]))

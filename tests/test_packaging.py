"""kernels/ and baselines/ ship inside logdiff: no top-level `kernels` package may shadow Hugging Face's."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_installed_package_has_no_top_level_kernels_or_baselines(tmp_path):
    """Our folders are importable as logdiff.kernels / logdiff.baselines only. Another distribution may ship
    a top-level `kernels` (transformers >= 5.25 requires Hugging Face's), so the test asks where a top-level
    name resolves to, not whether it exists: never to this repository."""
    probe = (
        "import importlib.util as u, logdiff.kernels, logdiff.baselines.baseline;"
        "print(*[(s.origin if s else 'None') for s in (u.find_spec('kernels'), u.find_spec('baselines'))], sep='\\n')"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    origins = out.stdout.splitlines()
    assert len(origins) == 2
    ours = [(ROOT / name).resolve() for name in ("kernels", "baselines")]  # not .nox/ or another venv in the checkout
    assert not [o for o in origins if o != "None" and any(Path(o).resolve().is_relative_to(d) for d in ours)], origins


def test_wheel_maps_the_top_level_folders_into_logdiff(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True,
    )
    (wheel,) = tmp_path.glob("logdiff-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "logdiff/kernels/attention.py" in names and "logdiff/baselines/naive.py" in names
    assert not [n for n in names if n.split("/")[0] in ("kernels", "baselines")]

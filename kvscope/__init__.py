"""KVScope's one installed name.

The wheel puts the checkout's top-level folders (app/, engine/, kernels/, integrations/,
kvscope_contract/, assets/) inside this package and writes their imports of each other as
`kvscope.<folder>` (setup.py), so nothing of KVScope's lands in site-packages under a name another
project may use. In a checkout those folders stay top-level and import each other as they are:
an editable install finds this package, which then puts the checkout on the path.
"""
from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
INSTALLED = (_HERE / "engine").is_dir()  # the wheel's layout: the folders are inside this package
if not INSTALLED and str(_HERE.parent) not in sys.path:
    sys.path.append(str(_HERE.parent))

"""fitdqn.ops sits below nets, losses and the replay: it imports only torch, fitdqn.errors, the neutral transition
contract fitdqn.transitions and itself (Triton in its ``*_triton`` modules alone, imported on first use), and
importing the domain packages imports no Triton."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import fitdqn.ops

OPS = Path(fitdqn.ops.__file__).parent
NEUTRAL = {"fitdqn.errors", "fitdqn.transitions"}  # leaf modules that import no other fitdqn module


def imports(path: Path) -> list[tuple[str, bool]]:
    """``(module, at top level)`` for every import in ``path``."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.module or "", id(node) in top))
    return found


def test_neutral_modules_import_no_fitdqn_module():
    for module in NEUTRAL:
        path = OPS.parent / (module.split(".")[1] + ".py")
        assert not [m for m, _ in imports(path) if m.split(".")[0] == "fitdqn"], path.name


def test_ops_imports_only_torch_errors_and_itself():
    modules = sorted(OPS.glob("*.py"))
    assert {"iqn.py", "attention.py", "projection.py", "quantile_huber.py", "sum_tree.py"} <= {m.name for m in modules}
    for path in modules:
        third_party = {"torch", "triton"} if path.stem.endswith("_triton") else {"torch"}
        for module, top_level in imports(path):
            package = module.split(".")[0]
            if package == "fitdqn":
                assert module in NEUTRAL or module.startswith("fitdqn.ops."), (path.name, module)
            else:
                assert package in third_party or package in sys.stdlib_module_names, (path.name, module)
            assert top_level, f"{path.name}: function-level import of {module}"


def test_importing_the_domain_imports_no_triton_and_registers_the_operators():
    code = ("import sys, torch, fitdqn.nets, fitdqn.learn, fitdqn.replay, json; print(json.dumps({"
            "'triton': 'triton' in sys.modules or any(m.endswith('_triton') for m in sys.modules), "
            "'ops': sorted(name for name in ('iqn_quantile_head', 'iqn_quantile_head_backward', "
            "'last_token_attention', 'last_token_attention_backward', 'categorical_projection', 'quantile_huber') "
            "if hasattr(torch.ops.fitdqn, name))}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"triton": False, "ops": sorted(["iqn_quantile_head", "iqn_quantile_head_backward",
                                                      "last_token_attention", "last_token_attention_backward",
                                                      "categorical_projection", "quantile_huber"])}

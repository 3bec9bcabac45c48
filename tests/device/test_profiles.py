import pytest

from fitdqn.device import load_profiles, match_profile
from fitdqn.device.profiles import parse_profile
from fitdqn.errors import UserError


@pytest.mark.parametrize(
    "name, profile, batch",
    [
        ("NVIDIA GeForce RTX 3050 Laptop GPU", "rtx3050", 64),
        ("NVIDIA GeForce RTX 3050", "rtx3050", 64),
        ("rtx3050", "rtx3050", 64),
        ("NVIDIA A100-SXM4-80GB", "a100", 2048),
        ("NVIDIA A100-PCIE-40GB", "a100", 2048),
        ("a100", "a100", 2048),
        ("NVIDIA H100 80GB HBM3", "h100", 8192),
        ("NVIDIA H100 PCIe", "h100", 8192),
        ("h100", "h100", 8192),
        ("NVIDIA H200", "h200", 16384),
        ("NVIDIA H200 NVL", "default", 256),
        ("NVIDIA GeForce RTX 3050 Ti", "rtx3050", 64),
        ("NVIDIA GeForce RTX 30500", "default", 256),
        ("Some Unknown GPU", "default", 256),
    ],
)
def test_matching_real_device_names(name, profile, batch):
    matched = match_profile(name, load_profiles())
    assert (matched.name, matched.batch_size) == (profile, batch)


def test_every_shipped_profile_says_where_its_numbers_came_from():
    for profile in load_profiles().values():
        assert profile.source["kind"] in ("plan", "measured")
        assert profile.source["description"] and profile.source["date"]


def test_user_profiles_add_and_override(tmp_path):
    (tmp_path / "h200.toml").write_text(
        'name = "h200"\nmatch = [\'\\bH200\\b\']\nbatch_size = 4096\n'
        '[source]\nkind = "measured"\ndescription = "fitdqn profile"\ndate = "2026-11-29"\n'
    )
    (tmp_path / "a100.toml").write_text(
        'name = "a100"\nmatch = [\'A100\']\nbatch_size = 1024\n'
        '[source]\nkind = "measured"\ndescription = "mine"\ndate = "2026-11-29"\n'
    )
    profiles = load_profiles(tmp_path)
    assert match_profile("NVIDIA H200", profiles).batch_size == 4096
    assert match_profile("NVIDIA A100-SXM4-80GB", profiles).batch_size == 1024


def test_profile_with_a_missing_field_is_named():
    with pytest.raises(UserError, match="lacks the field.*batch_size"):
        parse_profile('name = "x"\nmatch = []\n[source]\nkind="plan"\ndescription="d"\ndate="d"\n', "x.toml")
    with pytest.raises(UserError, match=r"\[source\] lacks date"):
        parse_profile('name = "x"\nmatch = []\nbatch_size = 8\n[source]\nkind="plan"\ndescription="d"\n',
                      "x.toml")


def test_profile_bad_values():
    base = '[source]\nkind="plan"\ndescription="d"\ndate="d"\n'
    with pytest.raises(UserError, match="positive integer"):
        parse_profile('name="x"\nmatch=[]\nbatch_size=0\n' + base, "x.toml")
    with pytest.raises(UserError, match="unknown field"):
        parse_profile('name="x"\nmatch=[]\nbatch_size=8\nbatch=9\n' + base, "x.toml")
    with pytest.raises(UserError, match="bad match pattern"):
        parse_profile('name="x"\nmatch=["(("]\nbatch_size=8\n' + base, "x.toml")


def test_missing_user_dir():
    with pytest.raises(UserError, match="does not exist"):
        load_profiles("/nonexistent/profiles")


def test_profile_driver_bytes_parse_as_count_or_size():
    base = 'name="x"\nmatch=[]\nbatch_size=8\n{}\n[source]\nkind="measured"\ndescription="d"\ndate="d"\n'
    assert parse_profile(base.format("driver_bytes = 312000000"), "x.toml").driver_bytes == 312_000_000
    assert parse_profile(base.format('driver_bytes = "300MiB"'), "x.toml").driver_bytes == 300 * 2**20
    assert parse_profile(base.format(""), "x.toml").driver_bytes is None
    with pytest.raises(UserError, match="driver_bytes must be a byte count"):
        parse_profile(base.format("driver_bytes = -1"), "x.toml")

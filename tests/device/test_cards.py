"""What-if devices get their card's facts by name; real device names find their profile, or say which was used."""

import pytest

from fitdqn.device import load_profiles, what_if
from fitdqn.device.cards import find_card, shipped_cards
from fitdqn.device.probe import what_if_device
from fitdqn.device.profiles import profile_with_note
from fitdqn.memory.overhead import cuda_overhead_component
from fitdqn.plan.build import profile_name_of

MIB, GIB = 2**20, 2**30

# (torch.cuda.get_device_name(), compute capability, SMs, total GiB (about), profile the name matches)
REAL_NAMES = [
    ("NVIDIA H200", (9, 0), 132, 139.8, "h200"),
    ("NVIDIA H200 NVL", (9, 0), 132, 139.8, "default"),
    ("NVIDIA GH200 480GB", (9, 0), 132, 95.6, "default"),
    ("NVIDIA GH200 144G HBM3e", (9, 0), 132, 134.1, "default"),
    ("NVIDIA H100 80GB HBM3", (9, 0), 132, 79.6, "h100"),
    ("NVIDIA H100 PCIe", (9, 0), 114, 79.6, "h100"),
    ("NVIDIA H100 NVL", (9, 0), 132, 93.6, "h100"),
    ("NVIDIA A100-SXM4-40GB", (8, 0), 108, 40.0, "a100"),
    ("NVIDIA A100-PCIE-40GB", (8, 0), 108, 40.0, "a100"),
    ("NVIDIA A100-SXM4-80GB", (8, 0), 108, 80.0, "a100"),
    ("NVIDIA A100 80GB PCIe", (8, 0), 108, 80.0, "a100"),
    ("NVIDIA L4", (8, 9), 58, 22.5, "default"),
    ("NVIDIA L40S", (8, 9), 142, 45.0, "default"),
    ("NVIDIA GeForce RTX 4090", (8, 9), 128, 24.0, "default"),
    ("NVIDIA GeForce RTX 3050 Laptop GPU", (8, 6), 16, 4.0, "rtx3050"),
    ("NVIDIA GeForce RTX 3050 Ti Laptop GPU", (8, 6), 20, 4.0, "rtx3050"),
    ("NVIDIA GeForce RTX 3050", (8, 6), 20, 8.0, "rtx3050"),
]


@pytest.mark.parametrize("name, capability, sms, total_gib, profile", REAL_NAMES)
def test_a_real_device_name_gives_its_cards_facts_and_profile(name, capability, sms, total_gib, profile):
    device = what_if(name, None, None)
    assert (device.compute_capability, device.sm_count) == (capability, sms)
    assert device.total_bytes == pytest.approx(total_gib * GIB, rel=0.01)
    assert device.free_bytes == device.total_bytes  # an idle card
    assert device.name == name and name in device.described_from
    matched, note = profile_with_note(profile_name_of(device, load_profiles()), load_profiles())
    assert matched.name == profile
    # a card without a profile of its own says which profile stands in, and where its numbers came from
    assert bool(note) == (profile == "default")
    if note:
        assert "'default' profile" in note and name in note and "fitdqn profile" in note


def test_aliases_name_cards_and_their_profiles():
    profiles = load_profiles()
    for alias, card, profile in (("h100", "NVIDIA H100 80GB HBM3", "h100"), ("rtx3050ti", None, "rtx3050"),
                                 ("h200-nvl", None, "default"), ("a100-40gb", None, "a100")):
        device = what_if(alias, None, None)
        assert device.name == alias  # the name the user gave, the card's facts behind it
        assert profile_with_note(profile_name_of(device, profiles), profiles)[0].name == profile, alias
        assert card is None or card in device.described_from
    assert find_card("h100").name == "NVIDIA H100 80GB HBM3"
    assert find_card("a100-40gb").total_bytes == 40960 * MIB
    assert find_card("rtx3050").name == "NVIDIA GeForce RTX 3050 Laptop GPU"  # the 4 GB card
    assert find_card("Some Unknown GPU") is None
    names = [card.name for card in shipped_cards()]
    assert len(names) == len(set(names))
    for card in shipped_cards():  # each card's own name finds it, not an earlier, broader pattern
        assert find_card(card.name) is card, card.name


def test_a_what_if_hopper_gets_the_hopper_workspace_rule():
    h100 = what_if("h100", None, None)
    # sm_90: 4096 KiB x 8 per handle, cuBLAS + cuBLASLt, two streams = 128 MiB (32.5 MiB on other cards)
    assert cuda_overhead_component(h100.compute_capability).fixed_bytes == 128 * MIB
    assert cuda_overhead_component(what_if("rtx3050", None, None).compute_capability).fixed_bytes == 32.5 * MIB


def test_an_unknown_card_is_planned_on_the_safe_side_with_a_warning():
    warned = what_if_device("Some Unknown GPU", None, 2 * GIB).described_from
    assert warned.startswith("warning:") and "give --total-memory" in warned and "h100" in warned
    device = what_if_device("Some Unknown GPU", 8 * GIB, None)
    assert device.compute_capability is None and device.sm_count is None
    assert "not in fitdqn's card table" in device.described_from and "give --total-memory" not in device.described_from
    # compute capability unknown: the larger (sm_90) workspace rule, never the smaller
    assert cuda_overhead_component(None).fixed_bytes == 128 * MIB
    assert what_if_device(None, None, 2 * GIB).free_bytes == 2 * GIB  # --free-memory alone: an unnamed card


def test_profiles_say_where_their_numbers_came_from_in_words():
    for profile in load_profiles().values():
        description = profile.source["description"]
        assert "shared/" not in description and "autobatchsizer" not in description
        assert profile.source["kind"] != "measured" or "fitdqn profile" in description

"""SpinVllmSettings' per-layer budgets: a calibrated sparsity profile for the served model (no vLLM needed:
the settings and the state builder are plain Python and torch)."""
import json

import pytest

from spin_indexer.integrations import settings as st
from spin_indexer.integrations.vllm_memory import build_state


def test_settings_take_a_calibrated_sparsity_profile(tmp_path):
    """sparsity_profile (a calibrate output) gives each layer the profile calibrated at the setting's sparsity,
    with profile_from; a file without that sparsity, a missing file or a non-path is refused at start-up,
    naming the setting; a profile of another layer count is refused where the model's state is built."""
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"profiles": {"0.3": [0.5, 1.5, 1.0], "0.4": [1.2, 0.6, 1.2]}}))
    s = st.load_settings({"spin": {"enable": True, "sparsity": 0.4, "sparsity_profile": str(path)}},
                         {"SPIN_PROFILE_FROM": "6144"})
    cfg = s.spin_config(512)
    assert cfg.sparsity_profile == (1.2, 0.6, 1.2) and cfg.profile_from == 6144
    assert [round(cfg.layer_sparsity(i), 6) for i in range(3)] == [0.48, 0.24, 0.48]
    ix, _ = build_state(s, 512, 3, 2, 4096, 1, 64, "meta")
    assert ix.config.sparsity_profile == (1.2, 0.6, 1.2)
    assert st.load_settings(None, {}).spin_config(512).sparsity_profile == ()  # none unless given
    with pytest.raises(ValueError, match=r"SpinVllmSettings.sparsity_profile \(.*\.json\): .* = 5 entries"):
        build_state(s, 512, 5, 2, 4096, 1, 64, "meta")
    with pytest.raises(ValueError, match="sparsity_profile.*no profile calibrated at sparsity 0.2"):
        st.load_settings(None, {"SPIN_SPARSITY": "0.2", "SPIN_SPARSITY_PROFILE": str(path)})
    with pytest.raises(ValueError, match="sparsity_profile: expected a readable profile.json"):
        st.load_settings(None, {"SPIN_SPARSITY_PROFILE": str(tmp_path / "none.json")})
    path.write_text(json.dumps({"profiles": {"0.4": [2.5, 0.5, 0.5]}}))  # layer 0 at 0.4 x 2.5 = 1: no budget
    with pytest.raises(ValueError, match="SpinVllmSettings.sparsity_profile: .*sparsity x every entry < 1"):
        st.load_settings(None, {"SPIN_SPARSITY": "0.4", "SPIN_SPARSITY_PROFILE": str(path)})
    with pytest.raises(TypeError, match="sparsity_profile: expected a path"):
        st.load_settings({"spin": {"sparsity_profile": 3}}, {})
    with pytest.raises(ValueError, match="SPIN_PROFILE_FROM: expected an int"):
        st.load_settings(None, {"SPIN_PROFILE_FROM": "long"})

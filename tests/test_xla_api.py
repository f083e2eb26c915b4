"""The private torch_xla entry points the project relies on, each named, so that a torch_xla
upgrade that renames or drops one fails here with the name and the file that needs it, instead
of deep inside a training step."""
import pytest
import torch_xla
import torch_xla.core.xla_builder as xb

PRIVATE_API = [
    # (where it is used, dotted path under torch_xla)
    ("sharding.py host_batch_to_global", "_XLAC._xla_tensors_from_aten"),
    ("training/capture.py CapturedComputation", "_XLAC._xla_set_enable_alias_with_buffer_donor_config"),
    ("training/capture.py CapturedComputation", "_XLAC._xla_user_computation"),
    ("training/capture.py donate", "_XLAC._set_buffer_donation"),
    ("training/capture.py CapturedComputation", "_XLAC.lowering.LoweringContext"),
    ("tests/test_train.py", "_XLAC._get_xla_sharding_spec"),
]
LOWERING_CONTEXT_METHODS = ["set_name_string", "build", "hlo", "device_parameter_id_tensor_mapping",
                            "tensor_parameter_id"]


@pytest.mark.parametrize("user, path", PRIVATE_API)
def test_private_torch_xla_entry_point_exists(user, path):
    obj = torch_xla
    for part in path.split("."):
        assert hasattr(obj, part), (f"torch_xla {torch_xla.__version__} has no torch_xla.{path}, which {user} "
                                    "calls: find its new name in this torch_xla, or pin the tested version")
        obj = getattr(obj, part)


def test_lowering_context_and_builder_have_what_capture_uses():
    context = torch_xla._XLAC.lowering.LoweringContext("probe")
    missing = [m for m in LOWERING_CONTEXT_METHODS if not hasattr(context, m)]
    missing += [f"xla_builder.{f}" for f in ("create_placeholder_tensor", "computation_from_module_proto")
                if not hasattr(xb, f)]
    assert not missing, f"torch_xla {torch_xla.__version__} lacks {missing}, used by training/capture.py"

"""build_arc writes the same bytes as the reference's dataset/build_arc_dataset.py.

The inputs are the hand-made tasks in tests/data/arc_tasks (Kaggle layout, prefix "tiny"):
  training:   0a1b2c3d (3x5 -> 5x3 grids), stripes (2x30, 1x30 and 30x1 grids), solid5 (one
              colour, symmetric shapes: most augmentations are duplicates; its JSON lists "test"
              before "train"), allblack (background only: a single distinct augmentation)
  evaluation: e1 (two test inputs), e2 (a 30x30 input)
  concept:    c1, with no solutions file (its test output is the dummy [[0]])

The expected hashes were recorded once by running the reference builder (SamsungSAILMontreal/
TinyRecursiveModels, dataset/build_arc_dataset.py, numpy 2.4.6) in a scratch directory outside
this repository on these files, e.g.
    python -m dataset.build_arc_dataset --input-file-prefix tests/data/arc_tasks/tiny \
        --output-dir OUT --subsets training evaluation concept --test-set-name evaluation \
        --num-aug 8
and taking the sha256 of every file it wrote.
"""
import hashlib
import os

import pytest

import build_data
import data
from puzzles.build_arc import build_arc

PREFIX = os.path.join(os.path.dirname(__file__), "data", "arc_tasks", "tiny")

# The reference builder's output for each case, as `sha256sum` lists it.
README_ORDER = """
518480d5eb80cdfbc916dd1fd11da3dc4d8c411a29627dfdbdd839ce9faf9252  identifiers.json
78168a8e52d98166682a7ebd35cd4accc91d549a74565c01d08039aab2bdd683  test/all__group_indices.npy
9c15f48682b3f0de2f6d97b5090158fc132d8c40d3626524f9cbb634e2656c1a  test/all__inputs.npy
19d5277893b413d0dc2cd549a6ddcbfb5b5d12330a02a23fad69e05e8d4e375f  test/all__labels.npy
c7350ec87a07ae903fac06133473081953ceaee37198cf9b1859f6051c715313  test/all__puzzle_identifiers.npy
0af0a1d5e1ee03b268c4d42759cc756ace91587b34ec9d8ae1c8a5874c6092da  test/all__puzzle_indices.npy
9259b74502560d817a8ecd23ce1428df6afd912dcd9334cb3403765e7202caf8  test/dataset.json
f573b9d20b97fa7d0b2be61ee3f092079f501967452e70c7018f19f0cb831750  test_puzzles.json
41af025f9e74fb625daf413ddae793739cb751af074e5a689c8035b7140cd9a2  train/all__group_indices.npy
a7a73096262be3652c2ecfb50b9b16aaddeabcda6daf3372392a2755d8a37137  train/all__inputs.npy
49e637feeb7b78fef8d51a9afeb22db6378ae6086701d13d882eda1fa57afb73  train/all__labels.npy
2b21f4977a5f74c95e90150c9360e7e72767c708e42a15aab8c338a477c8ebb1  train/all__puzzle_identifiers.npy
c7bf7c72341470a2f7c5bfe28a9c14167351995fd4680d5251b8ecb1a4f5c038  train/all__puzzle_indices.npy
edf76890c492e1845f025e150e3420f11a8c10ea05e6cf7dd1d9d5bd11352adf  train/dataset.json
"""
TEST_SET_FIRST = """
05a34e66779dbde395d8bc1ce3be0b0f9d6318b69f32af438161a3cf1ce6c510  identifiers.json
9461f3c67abb421033150f2fb3761c80f0aa17e5a0d021b99b531200bc9b99fd  test/all__group_indices.npy
12ece035679e8578f44e057e25320708bff1ea07c93a22880695f2e9d0658076  test/all__inputs.npy
5744106ae1f79ea156dc26c3948321c822d3e314e1688fe84afbf2eb31714ee2  test/all__labels.npy
6b6a61ea3707ca6256c7586baeb4bee1abcd0b082af047a36a5be3c71950bb6a  test/all__puzzle_identifiers.npy
09e6b9b99db78b1973fcaec4b3120f196c289daed4413a67d295dedc10570a97  test/all__puzzle_indices.npy
979c820e0025c7721d601689b4b63c4049af7a79eadc65bafc140948c3c334e1  test/dataset.json
27f83a81373d80906f7688e56cabdace241378a4a0d5137235bb5b0c120b34e8  test_puzzles.json
d7ffff40138c504f82321a2bab0b9b3a52553103923b14b1665107066685641b  train/all__group_indices.npy
b31cfb75935684d114438c168a2bd63da81d7b1be81c719f2530d777575c7be6  train/all__inputs.npy
dbe8cad210b27611df7442aacd458da0268f54ab05cd0032169bb9420a361be6  train/all__labels.npy
1322a469f79fa67c8e9be4fe97dfdc7ecb150f8a465a4166b6b08796df7ca5d3  train/all__puzzle_identifiers.npy
0dd5a51a278ff96377138178a8d4c423b392339234c55dc5db64c550194146e0  train/all__puzzle_indices.npy
59302a3382a8d2ab1286ce441d6e23df8e1e02496cbb20ffccfcffd7c0fffe08  train/dataset.json
"""

# name -> (build_arc keyword arguments, expected hashes)
CASES = {
    # The reference's README layout (train subsets first) with its default seed 42.
    "readme_order": (dict(subsets=["training", "evaluation", "concept"],
                          test_sets=["evaluation"], num_aug=8), README_ORDER),
    # The test set first, another seed and augmentation count. Here the reference's split order
    # comes from iterating a Python set, so its output depends on PYTHONHASHSEED; these hashes
    # are its train-first outcome (PYTHONHASHSEED=2), the one build_arc always takes.
    "test_set_first": (dict(subsets=["evaluation", "training"], test_sets=["evaluation"],
                            num_aug=3, seed=7), TEST_SET_FIRST),
}


def _hashes(table):
    return {path: digest for digest, path in (line.split() for line in table.strip().splitlines())}


def _written_files(root):
    found = {}
    for directory, _, files in os.walk(root):
        for name in files:
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return found


@pytest.mark.parametrize("case", sorted(CASES))
def test_build_arc_matches_reference_bytes(tmp_path, case):
    kwargs, table = CASES[case]
    expected = _hashes(table)
    out = str(tmp_path / "arc")
    build_arc(out, PREFIX, **kwargs)
    found = _written_files(out)
    assert sorted(found) == sorted(expected)
    wrong = [name for name in sorted(expected) if found[name] != expected[name]]
    assert not wrong, f"files that differ from the reference builder's: {wrong}"


def test_build_arc_command_line_defaults_to_the_reference_seed(tmp_path):
    out = str(tmp_path / "arc")
    build_data.main(["build-arc", "--out", out, "--input-prefix", PREFIX, "--subsets", "training",
                     "evaluation", "concept", "--test-sets", "evaluation", "--num-aug", "8"])
    assert _written_files(out) == _hashes(README_ORDER)


def test_build_arc_needs_a_test_set_among_the_subsets(tmp_path):
    with pytest.raises(data.DatasetError, match=r"none of the test sets \['evaluation2'\]"):
        build_arc(str(tmp_path / "arc"), PREFIX, subsets=["training"],
                             test_sets=["evaluation2"], num_aug=1)

"""Everything about models, in two halves (an import contract layers them).

The leaves, which decide nothing about this machine or the fleet:
- `errors`: what a pull raises (`ModelMissing`, one line) and the flag that cancels one;
- `ids`: ``org/repo[:QUANT]`` parsed, a model's name, the GGUF a repository is chosen by;
- `pulls/`: a model's files pulled from the hub (checked, resumable, shared), its header
  alone, and the fleet models' quota;
- `cache`: a model spec made a file here (a path, the cache, or a pull);
- `embedded`: the default model and the test model carried as wheels on PyPI;
- `store`: the models kept here, listed and removed;
- `catalog`: the models Shoal offers, with their shapes.

The deciders above them:
- `fit`: whether a model fits a machine, and how a fleet would split it;
- `machine`: this machine's facts (memory, devices, disk) for `fit`;
- `choice`: the catalog's models weighed against this machine and the fleet;
- `commands`: what the window and the CLI ask of the models (list, remove, fits);
- `loading`: a model made ready for a node or a head (pulled, runtime checked, loaded);
- `learn`: what a head learns of a model a fleet node serves (its tokenizer and template).
"""

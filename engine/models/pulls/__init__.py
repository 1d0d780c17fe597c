"""Pulling a model's files from the Hugging Face hub, in a way a user can trust.

- `hub`: the repository's files with their sizes and LFS sha256, and its commit;
- `plan` (pure): where a download resumes, how a response is taken, how much disk is
  missing;
- `disk`: the free-space reader (one function, so tests can give it a figure);
- `transfer`: one file streamed into ``$SHOAL_HOME/downloads/<sha256>.part``, resumed
  with ``Range``, hashed as it comes and checked before use;
- `shared`: one download per blob in this process, however many callers want it;
- `cache`: the finished blob installed into the hub's cache layout;
- `pull`: the files of a model, through all of the above;
- `meter` (pure): the rate and the time left; `text` (pure): how a pull reads.

Every expected failure is a `ModelMissing` with one line: the cause and the fix.
"""

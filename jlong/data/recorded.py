"""The data settings a run leaves unset, from what `jlong prepare` recorded
beside its token files.

- `data.loss_mask`: on when a token file of the run has a mask of trained
  ids (`jlong prepare --chat`), so those ids alone are trained.
- `data.eos_id`: for document sampling and for conversations, the
  end-of-document id the files' summaries (NAME.documents.json) record; for
  a mixture, each entry whose own recorded id differs gets it as its
  `eos_id`. Files that record none leave it to be set. Preference pairs
  refuse a set id other than the recorded one: their documents would run
  together.

A run's config is resolved once, before anything is built, and the resolved
values are what its run directory and checkpoints record.
"""

from __future__ import annotations

from jlong.config import Config
from jlong.config.loading import with_values
from jlong.data.corpus import TokenCorpus
from jlong.errors import JlongError


def with_recorded_data(config: Config) -> Config:
    """`config` with data.loss_mask and data.eos_id (and data.mix's eos_ids) filled in where unset."""
    data = config.data
    if data.source != "tokens":
        return config
    entries = data.mix_sources if data.mix is not None else None
    named = ([(f"data.mix[{i}].path", e.path, e.sampling or data.sampling) for i, e in enumerate(entries)]
             if entries is not None else [("data.path", data.path, data.sampling)])
    corpora = [(setting, TokenCorpus(path, setting), sampling) for setting, path, sampling in named]
    changes = {}
    for setting, corpus, sampling in corpora:
        recorded = corpus.prepared_with.get("eos_id")
        if sampling == "pairs" and data.eos_id is not None and recorded is not None and recorded != data.eos_id:
            raise JlongError(f"data.eos_id={data.eos_id}, but {corpus.named} closes each preference document with "
                             f"id {recorded} (recorded by jlong prepare --preference): drop data.eos_id or set it to "
                             f"{recorded}")
    if data.loss_mask is None:
        changes["loss_mask"] = any(corpus.masked for _, corpus, _ in corpora)
    if data.eos_id is None:
        needed = [(setting, corpus) for setting, corpus, sampling in corpora if corpus.masked or sampling == "documents"]
        recorded = [corpus.prepared_with.get("eos_id") for _, corpus in needed]
        for (setting, corpus), eos_id in zip(needed, recorded):
            if eos_id is None:
                raise JlongError(f"{setting} {'samples documents' if not corpus.masked else 'holds conversations'}, "
                                 f"but {corpus.named} records no end-of-document id: set data.eos_id")
        if recorded:
            changes["eos_id"] = recorded[0]
            if entries is not None:
                by_setting = dict(zip([s for s, _ in needed], recorded))
                changes["mix"] = [
                    {**raw, "eos_id": by_setting[setting]}
                    if raw.get("eos_id") is None and by_setting.get(setting, recorded[0]) != recorded[0] else raw
                    for raw, (setting, _, _) in zip(data.mix, named)]
    return with_values(config, data=changes) if changes else config

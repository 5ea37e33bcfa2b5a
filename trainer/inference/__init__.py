"""What a trained run is used for: loading its parameters (:mod:`.loading`), translating
(:class:`.translator.Translator`), generating text (:class:`.generator.Generator`) and
exporting them for other programs (:mod:`.export`, :mod:`.hf_export`)."""

"""The old home of the baselines' pure pieces, kept as an import path: each now lives in its method's module
(`fedjax_hetero.methods.fedgen_generator`, `methods.fedimpro`, `methods.fedin`)."""

from fedjax_hetero.methods.fedgen_generator import (
    PRESETS,
    FeatureHead,
    FedGenConfig,
    Generator,
    GeneratorState,
    client_coefficients,
    client_regularizer,
    decayed_coefficient,
    diversity_loss,
    ensemble_label_weights,
    ensemble_teacher_loss,
    feature_head,
    feature_width,
    generate,
    generator_loss,
    generator_optimizer,
    init_generator,
    make_generator,
    present_label_probs,
    sample_noise,
    stacked_head_logits,
    train_generator,
    train_generator_round,
)

__all__ = [
    "FeatureHead", "FedGenConfig", "Generator", "GeneratorState", "PRESETS", "client_coefficients",
    "client_regularizer", "decayed_coefficient", "diversity_loss", "ensemble_label_weights", "ensemble_teacher_loss", "feature_head",
    "feature_width", "generate", "generator_loss", "generator_optimizer", "init_generator", "make_generator",
    "present_label_probs", "sample_noise", "stacked_head_logits", "train_generator", "train_generator_round",
]

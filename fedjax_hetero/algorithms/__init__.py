"""Baseline algorithms' server- and client-side pieces as pure functions (engine-independent)."""

from fedjax_hetero.algorithms.fedgen import (
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

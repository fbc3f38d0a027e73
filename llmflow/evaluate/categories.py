"""MMLU's subject -> category map (the 57 subjects in four categories), as
lm-evaluation-harness groups them."""

from __future__ import annotations

STEM, HUMANITIES, SOCIAL_SCIENCES, OTHER = "stem", "humanities", "social_sciences", "other"
CATEGORIES = (STEM, HUMANITIES, SOCIAL_SCIENCES, OTHER)

_BY_CATEGORY = {
    STEM: (
        "abstract_algebra", "anatomy", "astronomy", "college_biology", "college_chemistry",
        "college_computer_science", "college_mathematics", "college_physics", "computer_security",
        "conceptual_physics", "electrical_engineering", "elementary_mathematics", "high_school_biology",
        "high_school_chemistry", "high_school_computer_science", "high_school_mathematics",
        "high_school_physics", "high_school_statistics", "machine_learning",
    ),
    HUMANITIES: (
        "formal_logic", "high_school_european_history", "high_school_us_history", "high_school_world_history",
        "international_law", "jurisprudence", "logical_fallacies", "moral_disputes", "moral_scenarios",
        "philosophy", "prehistory", "professional_law", "world_religions",
    ),
    SOCIAL_SCIENCES: (
        "econometrics", "high_school_geography", "high_school_government_and_politics",
        "high_school_macroeconomics", "high_school_microeconomics", "high_school_psychology",
        "human_sexuality", "professional_psychology", "public_relations", "security_studies", "sociology",
        "us_foreign_policy",
    ),
    OTHER: (
        "business_ethics", "clinical_knowledge", "college_medicine", "global_facts", "human_aging",
        "management", "marketing", "medical_genetics", "miscellaneous", "nutrition", "professional_accounting",
        "professional_medicine", "virology",
    ),
}

SUBJECT_CATEGORY: dict[str, str] = {s: category for category, subjects in _BY_CATEGORY.items() for s in subjects}


//! Who acts: the authenticated caller of an admin request (the API token's name), carried
//! with the work the request causes, so that every event and history row it writes names
//! them. Work the server starts on its own (sweeps, rollouts' later waves) names nobody.

use std::future::Future;

tokio::task_local! {
    static ACTOR: String;
}

/// Runs `work` on behalf of `actor`: what it writes is recorded as theirs.
pub async fn acting_as<F: Future>(actor: String, work: F) -> F::Output {
    ACTOR.scope(actor, work).await
}

/// Who the current work is done for, if a caller started it.
pub fn actor() -> Option<String> {
    ACTOR.try_with(Clone::clone).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_actor_is_known_inside_its_scope_only() {
        assert_eq!(actor(), None);
        let inside = acting_as("ops".into(), async { actor() }).await;
        assert_eq!(inside.as_deref(), Some("ops"));
        assert_eq!(actor(), None);
    }
}
